"""Parallelism: how ranks divide (``dims``), functions that apply a layout to a plain model (``parallelize``), each
model's tensor-parallel plan (``plans``), and the Lightning strategies built from them (``strategies``)."""
