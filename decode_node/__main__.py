from common.envs import setup_logging
from common.node.config import parse_node_args
from common.node.profiling import profiled
from decode_node.node import DecodeNode


def main() -> None:
    setup_logging("decode")
    node_config, engine_config = parse_node_args("pdserve decode node")
    with profiled("decode"):
        DecodeNode(node_config, engine_config).run()


if __name__ == "__main__":
    main()
