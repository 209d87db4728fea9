"""One page for any mix of runs: every figure, and beside it the measured ratios and the paper's numbers.

``bench report RESULTS_DIR...`` reads run directories (``meta.json`` and ``records.csv``; never writes into
them) of the experiments ``micro``, ``model``, ``scale``, ``converge``, ``models``, ``analysis`` (and
``soak``) and makes one section per figure of the paper each run reproduces:

==========================  ===========  ============================================================
section                     from         the ratio measured here
==========================  ===========  ============================================================
Figure 8, micro-benchmark   micro        other transport's median time / zero copy's, per size
Table 2, the models         models       model size, variables, compute ms/sample: here / the paper
                            model        model size moved per step / the paper's
Figure 7, tensor sizes      analysis     static/dynamic tensors, bytes, share above 10 KB and 1 MB
Figure 9, model throughput  model        zero copy's mini-batches/s / the other transport's
Figure 10, convergence      converge     time to target of grpc_tcp (and grpc_rdma) / zero copy's
Figure 11, scalability      scale        total throughput / the Local line's, / the 1-server one's
Figure 11 against measured  predict,     predicted total mini-batches/s / measured - 1, and Optimus's
                            scale        (a + b·N fitted to the 1- and 2-server steps): across runs
Figure 12, copy overhead    model        step time with the analysis off (or RDMA.cp) / on
==========================  ===========  ============================================================

Each section quotes the paper (:mod:`bench.ground.paper`, the one place its numbers live), says where the ratios
fall against them, and explains the differences from the run's own data: the fabric that carried the
tensors (``ucx:cma,posix,sysv`` is shared memory on one host, not an RDMA NIC), the cores, replayed compute,
launcher and link rate, batch sizes and servers, against the paper's 8 servers with P100 GPUs and 100 Gbps
InfiniBand.

The page is self-contained (figures embedded as PNG ``data:`` URIs, no script, no network); the Markdown
form has the same tables and refers to the figures as PNG files written beside it. Figures come from
:func:`bench.readers.plot.plot_run`, drawn into a temporary directory; a run whose figures fail keeps its tables
and gets a one-line note. matplotlib is only imported when figures are drawn.

The modules:

- :mod:`~bench.readers.report.sections`: one module per section above (``micro``, ``table2``, ``plan``,
  ``throughput``, ``converge``, ``scale``, ``copy_overhead``, ``soak``) that computes its ratios and rows from a
  run and says its prose (``predict``: from every predict and scale run of the page at once), and the registry
  :data:`~bench.readers.report.sections.SECTIONS` listing them in the page's order; :mod:`~bench.readers.report.text`
  (names of the lines, numbers and ratios as cells) and
  :mod:`~bench.readers.report.notes` (why the numbers differ) are what they share;
- :mod:`~bench.readers.report.page`: what a page is made of (tables, figures, sections, the report);
  :mod:`~bench.readers.report.overview`: the runs and the setup above the sections;
- :mod:`~bench.readers.report.build`: the runs read, their sections made and ordered, figures drawn and placed;
- :mod:`~bench.readers.report.html_page` and :mod:`~bench.readers.report.markdown_page`: the rendering (CSS,
  figure embedding), which knows no experiment; :mod:`~bench.readers.report.write`: the files written.
"""

from bench.readers.report.build import build_report, find_runs, run_labels
from bench.readers.report.html_page import render_html
from bench.readers.report.markdown_page import render_markdown
from bench.readers.report.notes import describe_fabric
from bench.readers.report.page import Figure, Report, ReportError, Section, Table
from bench.readers.report.sections import SECTIONS, Kind
from bench.readers.report.text import percent, times
from bench.readers.report.write import default_report_path, write_report
from bench.results import ResultsError

__all__ = ["SECTIONS", "Figure", "Kind", "Report", "ReportError", "ResultsError", "Section", "Table", "build_report",
           "default_report_path", "describe_fabric", "find_runs", "percent", "render_html", "render_markdown",
           "run_labels", "times", "write_report"]
