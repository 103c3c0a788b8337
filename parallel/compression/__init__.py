"""Gradient compression for the data-parallel reduction, one module per codec family.

- ``base``: the Codec and Reducer interfaces, error feedback, bucket flattening.
- ``casts``: fp16/bf16, and ``RingReducer``, which applies a codec at every ring hop.
- ``int8``: block-wise absmax int8, reduced by ``RingReducer``.
- ``topk``: top-k selection, its all-gather reducer and its momentum correction.
- ``powersgd``: low-rank P Q^T and its reducer.
- ``registry``: codec name -> implementation; ``make_reducer``, ``make_codec``.

Nothing is re-exported here: ``parallel.ring`` imports ``base`` for its identity codec
while the reducers import ``parallel.ring``, so this package imports nothing.
"""
