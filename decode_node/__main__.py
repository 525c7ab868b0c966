from common.node.loop import serve
from decode_node.node import DecodeNode

if __name__ == "__main__":
    serve("decode", DecodeNode)
