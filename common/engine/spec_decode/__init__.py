"""Speculative decoding: proposers draft tokens, the target verifies them in one forward.

A speculating sequence's decode step carries its last token plus K drafts; the runner feeds them
as K+1 decode rows (each row attends to the KV up to its own position, written in the same
forward), the sampler accepts a prefix of the drafts (`Sampler.verify`: exact for greedy,
rejection sampling otherwise) plus one token of its own, and the scheduler keeps only the KV of
verified positions.
"""
