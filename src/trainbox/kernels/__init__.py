"""Optional fast paths, each tested against a plain-torch reference: FlashAttention-4 (flash), the fused
head + cross-entropy (fused_ce), residual add + LayerNorm (fused_norm), the GELU MLP and MoE experts with the
activation in GEMM epilogues (fused_mlp), FP8 linears (fp8). `choice.choose` decides which one runs where;
`ops` registers their custom ops' compiler fallbacks."""
