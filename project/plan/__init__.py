"""Before launch, from the typed job: will it fit (the memory plan, each distinct device's step simulated on fake
tensors), how fast (the step-time model on a cluster), and which layout of the job's devices trains it fastest
(``plan=search``)."""
