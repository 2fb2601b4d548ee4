"""How the weights move: optimizers.py (fused AdamW and the device-side skip of a non-finite step), muon.py (Muon
for the blocks' matrices, AdamW for the rest), and the stability parts that need nothing of the run: clipping.py
(a fixed norm or a percentile of recent norms), time_density.py (the adaptive time density), convergence.py (the
gradient noise scale, the validation loss's slopes), smoothing.py (the bias-corrected EMA they share). Their
bundle and the rollback, which live in the checkpoint, are run/'s (stability.py, rollback.py).

May import: common.py, config/, data/, model/ and objectives/.
"""
