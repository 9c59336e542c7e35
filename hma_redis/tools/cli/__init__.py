"""``hma-redis``: main (arguments, output), doctor (the setup checks), admin (every Redis
command the CLI sends), text (printable output, error lines without secrets)."""
