"""Pipeline stages' layer ranges (pure Python) and what a pipelined node refuses before any
process starts."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.model.parallel import PPLayout, StageLayers
from common.node.config import NodeConfig
from decode_node.admission import PDAdmission


def test_even_stages_give_the_remainder_to_the_earlier_ones():
    layout = PPLayout.of(28, 3)
    assert layout.sizes == (10, 9, 9)
    assert [layout.layers(s) for s in range(3)] == [range(0, 10), range(10, 19), range(19, 28)]
    assert layout.stage_of(19) == 2
    stage = StageLayers.of(layout, 1)
    assert stage.layers == range(10, 19) and not stage.is_first and not stage.is_last
    assert StageLayers.of(PPLayout.of(28, 1), 0).is_whole


def test_an_explicit_partition_is_taken_as_written():
    assert PPLayout.of(28, 2, "10,18").layers(1) == range(10, 28)


@pytest.mark.parametrize(
    "layers,pp,partition,needle",
    [
        (28, 2, "10,17", "summing to the model's 28 layers"),
        (28, 2, "10,9,9", "must give 2 stages"),
        (28, 2, "10,x", "comma-separated ints"),
        (28, 2, "0,28", "at least one layer"),
        (3, 4, None, "pp=4 stages for 3 layers"),
        (28, 0, None, "pp must be >= 1"),
    ],
)
def test_bad_partitions_are_refused_naming_them(layers, pp, partition, needle):
    with pytest.raises(ValueError, match=needle):
        PPLayout.of(layers, pp, partition)


def test_a_partition_without_stages_and_a_pd_decode_node_with_stages_are_refused():
    with pytest.raises(ValueError, match="pp_layer_partition needs pp > 1"):
        EngineConfig(pp_layer_partition="10,18")
    with pytest.raises(ValueError, match="receiving KV runs one pipeline stage; this one has pp=2"):
        PDAdmission.rank_role(NodeConfig(), EngineConfig(pp=2))


def test_speculation_on_a_pipelined_node_is_refused_before_any_rank_starts(tmp_path):
    from common import LLM

    with pytest.raises(ValueError, match="pipelined nodes do not speculate"):
        LLM(None, device="cpu", pp=2, speculative_method="ngram", num_kv_blocks=16)
