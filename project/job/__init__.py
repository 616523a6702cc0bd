"""The typed job (``Job``: a run checked and resolved once from its config) and the contract every layout of its
devices declares (``Layout``), with the cluster it is planned for (``Cluster``)."""
