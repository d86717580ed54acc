"""Study management: declaring and running sweeps, reporting them, and the claims they support.

``sweep`` declares a grid (``sweep``/``product``/``zipped``, ``tune``, ``report_on``) and runs it
resumably; ``grid_edge`` extends a tuned grid past a winner at its edge; ``report`` (with
``report_figures`` and ``report_labels``) writes a sweep's tables and figures; ``reproduce``
runs the paper studies and writes the claims table; ``claims``, ``evidence``, ``provenance`` and
``regimes`` are what that table rests on (statistics, verdicts, where each trial came from).
Nothing below this package imports it: the training loop knows nothing of studies.
"""
