"""The real multi-process runtime: a parameter server process and meshes of worker processes.

``experiments.launch`` starts it; ``server.DistServer`` is the executor of the
one training loop on the server; ``worker.run_mesh`` is a mesh's process;
``wire`` is the gRPC transport; ``launch`` the roles and the local launcher;
``settings`` checks ``config.dist.*`` and what of a config the runtime can run.
"""
