"""Pipeline replicas: participants too small for the model train it together as stages.

``stage`` (a contiguous slice of layers), ``boundary`` (what crosses a stage boundary: hidden states
or their subspace coefficients, and the same model unsplit in one process), ``link`` (the per-window
process group at a rendezvous), ``schedule`` (one GPipe inner step), ``replica`` (a stage's window:
H steps, commit, its own contribution), ``trainer`` (a stage as the way a peer trains its windows:
``sparseloco-peer join --pipeline``).
"""
