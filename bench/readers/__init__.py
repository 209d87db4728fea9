"""The readers: what reads finished run directories and never measures.

- :mod:`bench.readers.plot`: a run's figures (PNG and SVG);
- :mod:`bench.readers.report`: one page (HTML or Markdown) for any mix of runs, set against the paper;
- :mod:`bench.readers.compare`: two runs of one experiment, point by point;
- :mod:`bench.readers.summary`: what a command prints at the end of its run.

They import only the ground (:mod:`bench.results`, :mod:`bench.ground.paper`, :mod:`bench.ground.sizes`,
...) and each other, never an experiment, the launch layer or the runtime.
"""
