"""Parallelism as plain functions and values: how ranks divide (``dims``), functions that apply a layout to a plain
model (``parallelize``), each model's tensor-parallel plan (``tensor_parallel_plans``), a rank's own part of a tensor
(``local_tensors``), and torch's fake process group, for meshes of any size in one process (``fake_process_group``)."""
