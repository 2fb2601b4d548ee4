"""The training options beside each method's own loss (which lives in its trainer), one file each with its own
test and logged loss term: repa.py (REPA's projector on the model and its alignment term), contrastive.py
(contrastive flow matching), xprediction.py (the network outputs x0; the loss stays on the velocity).

May import: common.py, config/, data/ and model/.
"""
