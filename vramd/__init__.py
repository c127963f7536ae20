"""vramd: several always-loaded models time-share one GPU.

Each model's daemon keeps its buffers in VRAM only while it holds the arena's
flock token; peers ring an inotify doorbell to ask for it.  See docs/.
"""

__version__ = "0.1.0"
