"""One run of each training-loop shape against torch.optim.Muon as shipped.

The loop-shape tests compare DMuon with torch's Muon whose bf16
Newton–Schulz is swapped for fp32, at 1e-5. Here the same tests run once each
against the unpatched torch.optim.Muon (bf16 Newton–Schulz) + AdamW, as a
user comparing the two would: torch_ref.bf16_reference() makes the reference
torch's Muon as shipped and compares how far each parameter has moved from
its initial value, at torch_ref.bf16_tol(): twice the largest distance of
torch's own bf16 Newton–Schulz from the same call in fp32, measured on the
reference's inputs in the same run, and never below 17 * 2^-8 (the rounding
bound derived in test_torch_muon.test_unpatched_bf16_muon). The test fails
as well if the worst difference is below 1e-4: the reference then did not
run in bf16 and the run proves nothing.
"""

import pytest

import test_grad_edits
import test_interrupts
import test_loop_shapes
import test_module_routing
import test_no_grad
import test_param_groups
import test_torch_convert
from torch_ref import bf16_reference, bf16_tol

pytestmark = pytest.mark.timeout(180)

CASES = {
    "none-grad branch": lambda mp, d: test_no_grad.test_branch_used_every_other_step(mp, d),
    "clip_grad_norm_ with overlap": lambda mp, d: test_grad_edits.test_clip_only_some_steps(d, mp),
    "GradScaler with an inf-skip": lambda mp, d: test_grad_edits.test_grad_scaler_with_inf_skip(
        d, mp),
    "skip a step": test_loop_shapes.test_skip_a_step,
    "two backwards": test_loop_shapes.test_two_backwards_per_step,
    "GAN": test_loop_shapes.test_gan_two_optimizers,
    "accumulation": lambda mp, d: test_loop_shapes.test_accumulation_the_torch_way(mp, d, True),
    "interrupt then continue": lambda mp, d: test_interrupts.test_interrupted_backward_is_rolled_back(
        mp, d, "backward hook fc2 (mid-way)", "zero_grad", KeyboardInterrupt),
    "ViT routing": lambda mp, d, capsys: (
        test_module_routing.test_vit_routed_by_module_trains_like_torch(mp, d, capsys)),
    "torch state dict to DMuon": test_torch_convert.test_torch_then_dmuon_in_another_parameter_order,
    "OneCycleLR": test_param_groups.test_one_cycle_lr_over_both_halves,
    "OneCycleLR cycling momentum": lambda mp, d: (
        test_param_groups.test_cycled_momentum_matches_torch(mp, d, "OneCycleLR", True)),
}


@pytest.mark.parametrize("case", CASES)
def test_against_torch_muon_as_shipped(monkeypatch, daemon, capsys, case):
    with bf16_reference() as seen:
        if case == "ViT routing":  # it checks the routing table it prints
            CASES[case](monkeypatch, daemon, capsys)
        else:
            CASES[case](monkeypatch, daemon)
    print(f"{case}: worst relative difference {seen['worst']:.2e}, torch's bf16 "
          f"Newton–Schulz {seen['ns']:.2e} from fp32 (tol {bf16_tol():.2e})")
    assert seen["worst"] > 1e-4, "the reference ran in fp32: this test no longer tests bf16"
