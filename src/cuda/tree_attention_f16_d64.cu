// Instantiation: tree-attention kernel for f16, head_dim 64.
#include "cuda/tree_attention_launch.cuh"

FASTTREE_INSTANTIATE_TREE_KERNEL(fasttree::cuda_detail::kDTypeF16, 64)
