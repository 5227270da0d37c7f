"""Pipeline stages as plain functions (no Prefect): data, sft, reward, ppo, evaluate."""
