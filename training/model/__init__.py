"""The network: mmdit.py (the conditioned MMDiT: the conditioner, guidance, its build, and an export's model read
back) and transfer.py (what init_from does to another run's tensors: the positional grid resampled, classes
mapped by id). Where a run's model comes from at its start is run/start.py's.

May import: common.py, config/ and data/.
"""
