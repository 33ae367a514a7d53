#!/usr/bin/env python3
"""The floor model of bench/compare_reference.py ("The floor" in docs/BENCHMARKS.md).

The floor says which speed targets (TARGETS in bench/compare_reference.py) no implementation of
a column's arithmetic could meet on the machine a comparison ran on, so its flop counts must be
right. They are checked here against counts worked out by hand for single shapes (the numbers in
the tests, not the model's formulas), against the effective-flop convention of
bench/orthogonalize_bench.cc, and the table itself is rendered from a synthetic result through
the script's --render path, as a user would. Standard library only.

usage: bench_floor_test.py REPO_ROOT
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = sys.argv.pop(1) if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "compare_reference.py")
spec = importlib.util.spec_from_file_location("compare_reference", SCRIPT)
cr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cr)


class PolarExpressFlops(unittest.TestCase):
    def test_full_products_match_the_benchmark_convention(self):
        # orthogonalize_bench.cc: 5 × (4m²n + 2m³) for a wide m×n (m <= n).
        for m, n in [(1024, 1024), (1024, 4096), (192, 768)]:
            self.assertEqual(cr.polar_express_flops(m, n, symmetric=False),
                             5 * (4 * m * m * n + 2 * m ** 3))
        # Orientation does not matter: a tall matrix works on its shorter side.
        self.assertEqual(cr.polar_express_flops(4096, 1024, symmetric=False),
                         cr.polar_express_flops(1024, 4096, symmetric=False))

    def test_one_triangle_per_symmetric_product(self):
        # 768×3072 by hand: Gram 768²·3072 = 1,811,939,328; A·A 768³ = 452,984,832;
        # B·Y 2·768²·3072 = 3,623,878,656; five iterations.
        self.assertEqual(cr.polar_express_flops(768, 3072), 5 * 5_888_802_816)
        # Square: 4 of the full count's 6 units of m³.
        self.assertEqual(3 * cr.polar_express_flops(512, 512),
                         2 * cr.polar_express_flops(512, 512, symmetric=False))


class OrthoCap(unittest.TestCase):
    def test_the_best_of_ceiling_each_benchmark_row_can_show(self):
        # Square: 6 units of m³ counted, 4 needed. 1024×4096: (16 + 2) / (4 + 1 + 8) = 18/13.
        self.assertAlmostEqual(cr.ortho_of_ceiling_cap("PE_fp32", "1024×1024"), 1.5)
        self.assertAlmostEqual(cr.ortho_of_ceiling_cap("PE_bf16onednn", "1024×4096"), 18 / 13)
        self.assertAlmostEqual(cr.ortho_of_ceiling_cap("PE_fp32openblas", "4096×1024"), 18 / 13)
        # The float32_gemm engine needs the full products: its row cannot exceed 1.
        self.assertAlmostEqual(cr.ortho_of_ceiling_cap("PE_bf16", "1024×1024"), 1.0)
        self.assertIsNone(cr.ortho_of_ceiling_cap("NS5_fp32", "1024×1024"))
        self.assertIsNone(cr.ortho_of_ceiling_cap("PE_fp32", "None×None"))


class DionFlops(unittest.TestCase):
    def test_square_rank_one_uses_householder_qr(self):
        # 768×768, rank fraction 1 (r = 768, P square): four 2·768³ products and geqrf + orgqr
        # (4/3 r³ each).
        r3 = 768 ** 3
        self.assertAlmostEqual(cr.dion_flops(768, 768, 1.0), 8 * r3 + 8 * r3 / 3)

    def test_tall_quarter_rank_uses_randomized_cholesky_qr(self):
        # 3072×768 at rank ¼: r = 192, sketch rows k = 128·⌈1.25·192/128⌉ = 256.
        a, b, r, k = 3072, 768, 192, 256
        products = 4 * 2 * a * b * r               # 3,623,878,656
        sketch = 2 * k * a * r                     # S·P: 301,989,888
        r_of_sketch = 2 * k * r * r - 2 * r ** 3 / 3
        solves_and_gram = 3 * a * r * r            # two triangular solves and PᵀP's triangle
        cholesky = r ** 3 / 3
        want = products + sketch + r_of_sketch + solves_and_gram + cholesky
        self.assertAlmostEqual(cr.dion_flops(a, b, 0.25), want)
        # A wide matrix is the transposed problem.
        self.assertAlmostEqual(cr.dion_flops(b, a, 0.25), want)


class Selection(unittest.TestCase):
    def test_dion2_picks_the_shorter_side_and_nordion2_rows(self):
        self.assertEqual(cr.selected_shape(768, 3072, 0.25, False), (192, 3072))
        self.assertEqual(cr.selected_shape(3072, 768, 0.25, False), (3072, 192))
        self.assertEqual(cr.selected_shape(3072, 768, 0.25, True), (768, 768))
        self.assertEqual(cr.selected_shape(768, 768, 0.25, True), (192, 768))


class StepFlops(unittest.TestCase):
    def test_one_layer_muon(self):
        # 4 × 768² and 768×3072 and 3072×768, one triangle per symmetric product.
        square = 5 * 4 * 768 ** 3
        wide = 5 * 5_888_802_816
        self.assertEqual(cr.step_flops("muon", "fp32", 1), (4 * square + 2 * wide, "fp32"))
        self.assertEqual(cr.step_flops("muon", "onednn", 1), (4 * square + 2 * wide, "bf16"))
        # The float32_gemm engine needs the full products, at the fp32 rate.
        full = cr.step_flops("muon", "float32_gemm", 1)
        self.assertEqual(full[1], "fp32")
        self.assertEqual(full[0], sum(cr.polar_express_flops(m, n, False)
                                      for m, n in cr.matrix_shapes(1)))

    def test_the_rows_options_decide_the_shapes(self):
        # Dion2 (¼) on one layer: 4 × 192×768, 192×3072 and 3072×192; Dion rank ¼ at r = 192.
        want = 4 * cr.polar_express_flops(192, 768) + 2 * cr.polar_express_flops(192, 3072)
        self.assertEqual(cr.step_flops("dion2", "fp32", 1), (want, "fp32"))
        self.assertAlmostEqual(cr.step_flops("dion_r4", "fp32", 1)[0],
                               4 * cr.dion_flops(768, 768, 0.25) + 2 * cr.dion_flops(3072, 768, 0.25))

    def test_layers_scale_the_work_and_dion_has_no_bf16_column(self):
        self.assertEqual(cr.step_flops("dion_r4", "fp32", 12)[0],
                         12 * cr.step_flops("dion_r4", "fp32", 1)[0])
        self.assertIsNone(cr.step_flops("dion_r1", "onednn", 1))
        self.assertIsNone(cr.step_flops("adamw", "fp32", 1))


def synthetic_result():
    """A result as main() writes it: one layer, Dion rank 1 and Dion2 rows, both columns."""
    return {
        "started_utc": "2026-01-01 00:00 UTC", "command": "test", "reference_mode": "test",
        "torch": "0", "python": "3", "layers": 1, "rounds": 1, "warmup": 0, "threads": 2,
        "load_before": ["0"], "load_after": ["0"], "wall_s": 1.0, "bf16_matmul_auto": "onednn",
        "modes": {"fp32": "fp32", "bf16_reference": "bf16_reference (auto: onednn)",
                  "bf16_reference:other": "bf16_reference (float32_gemm)"},
        "rows": {
            "dion_r1": {"label": "Dion, rank 1", "params": 1, "reference": {"median_s": 0.5,
                                                                            "min_s": 0.5},
                        "fp32": {"median_s": 0.4, "min_s": 0.4}},
            "dion2": {"label": "Dion2 (¼)", "params": 1, "reference": {"median_s": 1.0,
                                                                        "min_s": 1.0},
                      "fp32": {"median_s": 0.3, "min_s": 0.3},
                      "bf16_reference": {"median_s": 0.2, "min_s": 0.2},
                      "bf16_reference:other": {"median_s": 0.6, "min_s": 0.6}},
        },
        "ortho": {"ceilings": {"f32_onednn": 150.0, "f32_openblas": 200.0,
                               "bf16_onednn": 400.0}, "rows": []},
    }


class FloorRows(unittest.TestCase):
    def test_floor_ratios_and_targets(self):
        rows = {(f["row"], f["mode"]): f for f in cr.floor_rows(synthetic_result())}
        # Dion rank 1 on one layer, by hand: 4 squares (8·768³ + 8·768³/3 each) and two
        # 3072×768 at r = 768 (k = 1024).
        a, b, r, k = 3072, 768, 768, 1024
        tall = (8 * a * b * r + 2 * k * a * r + 2 * k * r * r - 2 * r ** 3 / 3
                + 3 * a * r * r + r ** 3 / 3)
        flops = 4 * (8 * 768 ** 3 + 8 * 768 ** 3 / 3) + 2 * tall
        f = rows[("dion_r1", "fp32")]
        # The faster f32 engine's ceiling (200), then ÷ the reference's median.
        self.assertAlmostEqual(f["floor_s"], flops / 200e9)
        self.assertAlmostEqual(f["floor_ratio"], flops / 200e9 / 0.5)
        self.assertEqual(f["target"], 0.5)
        self.assertAlmostEqual(f["measured_ratio"], 0.8)
        # bf16 auto (oneDNN) runs at the bf16 ceiling and carries the target; the other engine
        # is reported without one.
        self.assertEqual(rows[("dion2", "bf16_reference")]["target"], 0.5)
        self.assertIn("bf16 ceiling 400", rows[("dion2", "bf16_reference")]["work"])
        self.assertIsNone(rows[("dion2", "bf16_reference:other")]["target"])
        self.assertIn("fp32 ceiling 200", rows[("dion2", "bf16_reference:other")]["work"])

    def test_no_ceilings_no_floor(self):
        res = synthetic_result()
        del res["ortho"]
        self.assertEqual(cr.floor_rows(res), [])

    def test_render_prints_the_floor_table(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "result.json")
            with open(path, "w") as f:
                json.dump(synthetic_result(), f)
            md_path = os.path.join(d, "out.md")
            out = subprocess.run([sys.executable, SCRIPT, "--render", path, "--markdown",
                                  md_path], check=True, capture_output=True, text=True).stdout
            with open(md_path) as f:
                self.assertEqual(f.read(), out[:-1])  # print() adds one newline
        # Dion rank 1's floor is above its 0.5 target in this synthetic run (about 0.71).
        line = [l for l in out.splitlines() if l.startswith("| Dion, rank 1 | fp32 |")]
        self.assertEqual(len(line), 1, out)
        self.assertIn("(above the target)", line[0])
        self.assertIn("| ≤ 0.5 | 0.80 |", line[0])

    def test_run_without_reference_or_render_is_refused(self):
        p = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--reference is required", p.stderr)


if __name__ == "__main__":
    unittest.main()
