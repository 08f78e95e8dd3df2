"""The installed environment: torch-fidelity imports (it needs a torchvision matching torch)."""


def test_torch_fidelity_and_torchvision_ops_import():
    import torch
    import torch_fidelity
    import torchvision

    assert hasattr(torch_fidelity, "calculate_metrics")
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    kept = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5)  # fails if torchvision's ops are broken
    assert kept.tolist() == [0]
