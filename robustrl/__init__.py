"""RobustRL: fault-tolerant RL post-training."""
__version__ = "0.1.0"
