"""What a training step costs, counted as it runs, on a real run or a simulated one: its FLOPs and the bytes of each
collective (``counts``), and the memory a device holds (``memory_trackers``)."""
