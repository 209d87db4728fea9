"""The commands of ``bench``, one module each.

A command module has a docstring (its ``--help`` description), ``HELP`` (its line in ``bench --help``),
``EXAMPLES`` (command lines and what each does, at the end of its ``--help``), ``add_arguments(parser)`` and
``run(args)``; a command that starts ranks sets ``STARTS_RANKS = True`` and
takes ``run(args, launcher)`` (``bench.cli`` makes the launcher from ``--launcher`` and closes it); one that needs
an optional part of the install names it in ``EXTRAS`` (``bench.options.EXTRAS``), checked before anything starts.
Options several commands share are parsed in ``bench.options``; what commands that write a run share is in
``bench.commands.common``.
"""

#: the commands, in the order of ``bench --help``
COMMANDS = ("info", "doctor", "micro", "model", "scale", "predict", "converge", "soak", "models", "analyze", "plot",
            "report", "compare")
