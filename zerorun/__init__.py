"""zerorun: a DeepSpeed launcher that checks memory before it launches."""
__version__ = "0.1.0"
