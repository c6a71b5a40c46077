"""``python -m asyncllm.bench`` = ``python -m asyncllm bench``."""

import sys

from asyncllm.bench.runner import main

sys.exit(main(sys.argv[1:]))
