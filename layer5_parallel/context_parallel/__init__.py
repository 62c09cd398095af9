"""Context parallelism: one long sequence split over the ranks (ring attention).

ring_attention.py: each rank holds a load-balanced share of the sequence's Q, K and V; the K/V
pieces travel round the ring while each rank attends to the piece it holds, merging partial
softmaxes (lab 5, exercise 2 builds `attention_block` and `merge_partial`). Its names reach
users through layer 5's own __init__, which imports them from ring_attention.py.
"""
