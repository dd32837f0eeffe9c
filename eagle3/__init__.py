"""eagle3ctl: train EAGLE-3 speculative-decoding drafters as manifest-checked stages."""

__version__ = "0.1.0"
