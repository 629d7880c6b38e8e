"""The reference's capture points: the names under which a forward pass exposes its activations
(`forward(capture=...)`), and under which every engine adapter returns its own (subjects/engines).
`-*` stands for the layer index."""

REFERENCE_POINTS = ("l_out-*", "attn_norm-*", "q_pe-*", "k_pe-*", "Qcur-*", "Kcur-*", "kqv_out-*", "ffn_inp-*",
                    "ffn_norm-*", "ffn_out-*", "ffn_moe_topk-*", "ffn_moe_scores-*", "top_k-*", "indexer_score-*",
                    "result_norm")
