from common.node.loop import serve
from prefill_node.node import PrefillNode

if __name__ == "__main__":
    serve("prefill", PrefillNode)
