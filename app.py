"""Launch the DSpark Gradio demo: ``python app.py [--port P] [--share false] [--target T] [--drafter D]``.

A thin launcher for ``dspark demo`` (see :mod:`dspark_hf.demo.app`); the port also honours $GRADIO_SERVER_PORT.
"""

import sys

from dspark_hf.cli.main import main

if __name__ == "__main__":
    main(["demo", *sys.argv[1:]])
