"""The ONNX Runtime side of eectl: sessions over an exported artifact, and the early-exit runner."""
