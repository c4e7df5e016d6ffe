"""The CPU ceiling: which engine a bundle runs on (`engine_choice`), and what a request costs
beside its model call (`floor`)."""
