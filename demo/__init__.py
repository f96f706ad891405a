"""The demo behind `make demo`: a preempted Tunix run resumed by stock Tunix and by ckpt_iter.

Not part of the installed package (the wheel holds the library only): run it
from a clone of the repository, `make demo` or `python -m demo --help`.
`toyrun` is the toy GRPO run on Tunix's toy model (also the benchmarks'
workload and the base of the tests' toy), `agentic_toyrun` the agentic one.
"""
