from common.node_config import parse_node_args, setup_logging
from prefill_node.node import PrefillNode


def main() -> None:
    setup_logging("prefill")
    node_config, engine_config = parse_node_args("pdserve prefill node")
    PrefillNode(node_config, engine_config).run()


if __name__ == "__main__":
    main()
