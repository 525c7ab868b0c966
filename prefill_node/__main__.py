from common.envs import setup_logging
from common.node.config import parse_node_args
from common.node.profiling import profiled
from prefill_node.node import PrefillNode


def main() -> None:
    setup_logging("prefill")
    node_config, engine_config = parse_node_args("pdserve prefill node")
    with profiled("prefill"):
        PrefillNode(node_config, engine_config).run()


if __name__ == "__main__":
    main()
