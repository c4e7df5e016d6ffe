"""bertserve: BERT-class NLU served from ONNX bundles. `bertserve --help` lists the commands."""

__version__ = "0.1.0"
