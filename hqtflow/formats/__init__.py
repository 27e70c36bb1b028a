"""Every on-disk layout hqtflow reads or writes lives in this package."""
