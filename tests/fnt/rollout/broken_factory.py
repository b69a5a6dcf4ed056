"""A factory that raises, for the pooled-environment tests: its module imports nothing heavy, so
a worker process reaches the raise in a fraction of a second. Pure, apart from the raise."""


def build(rollout):
    raise RuntimeError("no sandbox today")
