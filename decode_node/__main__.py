from common.node_config import parse_node_args, setup_logging
from common.profiling import profiled
from decode_node.node import DecodeNode


def main() -> None:
    setup_logging("decode")
    node_config, engine_config = parse_node_args("pdserve decode node")
    with profiled("decode"):
        DecodeNode(node_config, engine_config).run()


if __name__ == "__main__":
    main()
