"""What the tests build on: the hand-written reference loop, probe callbacks for inside the workers, the preloaded
``train.py`` server and the reader of W&B's offline files."""
