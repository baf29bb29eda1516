"""The one start-up path: a model and its configuration -> programs and weights -> CompiledModel;
exported directories."""
