"""dsaserve: an inference engine for DSA-MoE models (GLM-5.x `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`)."""

__version__ = "0.1.0"
