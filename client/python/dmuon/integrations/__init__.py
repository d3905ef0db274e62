"""DMuon in other projects' trainers, each an optional dependency imported
only by its own module (importing dmuon or dmuon.integrations imports none):

    dmuon.integrations.torchtitan   DMuonOptimizersContainer, torchtitan's
                                    optimizer container (pip install torchtitan==0.3.0)

transformers.Trainer and Lightning need no module here: they take a DMuon
as their optimizer (client/python/examples/hf_trainer.py,
lightning_trainer.py).
"""
