"""`python -m jaxengine` runs the command line."""

from jaxengine.cli import main

main()
