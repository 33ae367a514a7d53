//! Trains a small MLP through the daemon over shared memory, printing the loss as it falls.
//!
//!   cargo run --offline --example train_mlp -- unix:/run/diond.sock
//!
//! (target: the first argument, else $DIOND_TARGET, else unix:/run/diond.sock).
//!
//! The model is y = W2 tanh(W1 x + b1) + b2 with hand-written backprop, fit by mean squared
//! error to a fixed random "teacher" network of the same shape. The weight matrices are
//! optimized with Muon and the biases with AdamW, both by the daemon: each step this program
//! reads the weights from the shm arena, writes the gradients into it, and calls Step.

use diond::{Algorithm, Client, Group, SessionSpec};

const IN: usize = 16;
const HIDDEN: usize = 64;
const OUT: usize = 8;
const BATCH: usize = 256;

/// Deterministic normal-ish values: a 64-bit LCG summed over 4 uniforms, scaled by `scale`.
fn randn(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut uniform = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32) / ((1u64 << 24) as f32)
    };
    (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 1.7320508 * scale).collect()
}

/// y[b, o] = sum_h w[o, h] x[b, h] + bias[o], row-major.
fn affine(x: &[f32], w: &[f32], bias: &[f32], rows_in: usize, rows_out: usize) -> Vec<f32> {
    let mut y = vec![0f32; BATCH * rows_out];
    for b in 0..BATCH {
        for o in 0..rows_out {
            let mut acc = bias[o];
            for i in 0..rows_in {
                acc += w[o * rows_in + i] * x[b * rows_in + i];
            }
            y[b * rows_out + o] = acc;
        }
    }
    y
}

struct Teacher {
    x: Vec<f32>,
    y: Vec<f32>,
}

fn teacher() -> Teacher {
    let x = randn(1, BATCH * IN, 1.0);
    let w1 = randn(2, HIDDEN * IN, 1.0 / (IN as f32).sqrt());
    let b1 = randn(3, HIDDEN, 0.1);
    let w2 = randn(4, OUT * HIDDEN, 1.0 / (HIDDEN as f32).sqrt());
    let b2 = randn(5, OUT, 0.1);
    let h: Vec<f32> = affine(&x, &w1, &b1, IN, HIDDEN).iter().map(|v| v.tanh()).collect();
    let y = affine(&h, &w2, &b2, HIDDEN, OUT);
    Teacher { x, y }
}

/// Trains for `steps` steps on the daemon at `target`; returns the loss before each step.
pub fn train(target: &str, steps: usize, print: bool) -> diond::Result<Vec<f32>> {
    let client = Client::connect(target)?;
    let spec = SessionSpec::new()
        .client_name("train_mlp example")
        .group(Group::new("matrices", Algorithm::Muon).lr(0.02).weight_decay(0.0))
        .group(Group::new("biases", Algorithm::Adamw).lr(0.01).weight_decay(0.0))
        .param("w1", &[HIDDEN as i64, IN as i64], "matrices")
        .param("b1", &[HIDDEN as i64], "biases")
        .param("w2", &[OUT as i64, HIDDEN as i64], "matrices")
        .param("b2", &[OUT as i64], "biases");
    let mut session = client.create_session(&spec)?;
    let arena = session.attach_shm()?;
    // The student starts from its own random weights, written straight into the shm arena.
    arena.param_mut("w1")?.copy_from_slice(&randn(10, HIDDEN * IN, 1.0 / (IN as f32).sqrt()));
    arena.param_mut("w2")?.copy_from_slice(&randn(11, OUT * HIDDEN, 1.0 / (HIDDEN as f32).sqrt()));
    let data = teacher();

    let mut losses = Vec::with_capacity(steps);
    for step in 1..=steps {
        let arena = session.arena_mut().expect("attached");
        let loss = {
            let mut views = arena.views_mut()?;
            let mut by_name: std::collections::BTreeMap<&str, (&mut [f32], &mut [f32])> =
                views.iter_mut().map(|v| (v.name, (&mut *v.param, &mut *v.grad))).collect();
            let (w1, gw1) = by_name.remove("w1").unwrap();
            let (b1, gb1) = by_name.remove("b1").unwrap();
            let (w2, gw2) = by_name.remove("w2").unwrap();
            let (b2, gb2) = by_name.remove("b2").unwrap();
            // Forward.
            let h: Vec<f32> = affine(&data.x, w1, b1, IN, HIDDEN).iter().map(|v| v.tanh()).collect();
            let y = affine(&h, w2, b2, HIDDEN, OUT);
            let n = (BATCH * OUT) as f32;
            let mut loss = 0f32;
            let mut dy = vec![0f32; BATCH * OUT];
            for i in 0..BATCH * OUT {
                let e = y[i] - data.y[i];
                loss += e * e / n;
                dy[i] = 2.0 * e / n;
            }
            // Backward.
            gw1.fill(0.0);
            gb1.fill(0.0);
            gw2.fill(0.0);
            gb2.fill(0.0);
            let mut dh = vec![0f32; BATCH * HIDDEN];
            for b in 0..BATCH {
                for o in 0..OUT {
                    let g = dy[b * OUT + o];
                    gb2[o] += g;
                    for k in 0..HIDDEN {
                        gw2[o * HIDDEN + k] += g * h[b * HIDDEN + k];
                        dh[b * HIDDEN + k] += g * w2[o * HIDDEN + k];
                    }
                }
            }
            for b in 0..BATCH {
                for k in 0..HIDDEN {
                    let hk = h[b * HIDDEN + k];
                    let g = dh[b * HIDDEN + k] * (1.0 - hk * hk);
                    gb1[k] += g;
                    for i in 0..IN {
                        gw1[k * IN + i] += g * data.x[b * IN + i];
                    }
                }
            }
            loss
        };
        losses.push(loss);
        if print && (step == 1 || step % 25 == 0 || step == steps) {
            println!("step {step:4}  loss {loss:.6}");
        }
        session.step(step as i64)?;
    }
    session.close()?;
    Ok(losses)
}

#[allow(dead_code)]
fn main() {
    let target = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DIOND_TARGET").ok())
        .unwrap_or_else(|| "unix:/run/diond.sock".to_string());
    match train(&target, 200, true) {
        Ok(l) => println!("loss {:.6} -> {:.6}", l[0], l[l.len() - 1]),
        Err(e) => {
            eprintln!("train_mlp: {e}");
            std::process::exit(1);
        }
    }
}
