"""The ``jaxckpt`` command line: one module per subcommand group over the public API.

``main`` parses arguments and maps errors to exit codes; ``inspect`` (inspect, ls),
``verify``, ``export`` (export, convert) do the work; ``text`` formats what they print.

May import: anything in jaxckpt; nothing imports it but ``jaxckpt.__main__``.
"""
