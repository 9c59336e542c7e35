"""``hma-redis``: main (the parser, and which command runs), commands (one module per command),
options (the connection options, the config they make), output (stdout, error lines, exit
codes), doctor (the setup checks), admin (every Redis command the CLI sends), text (printable
output, error lines without secrets)."""
