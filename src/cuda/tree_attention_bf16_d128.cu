// Instantiation: tree-attention kernel for bf16, head_dim 128.
#include "cuda/tree_attention_launch.cuh"

FASTTREE_INSTANTIATE_TREE_KERNEL(fasttree::cuda_detail::kDTypeBF16, 128)
