//! Tensors as the streaming RPCs move them: named byte strings cut into `TensorChunk`s, and
//! reassembled from them.

use std::collections::BTreeMap;

use crate::error::{Code, Error, Result};
use crate::proto;
use crate::spec::Dtype;

/// The most data bytes one `TensorChunk` may carry (optimizer.proto).
pub const MAX_CHUNK_BYTES: usize = 4 << 20;

/// One tensor's bytes in the trainer's dtype, with the shape and dtype the daemon reported
/// (empty / `None` for tensors this side built from bytes alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tensor {
    pub shape: Vec<i64>,
    pub dtype: Option<Dtype>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// An fp32 tensor (little-endian bytes, as the daemon stores them).
    pub fn from_f32(shape: &[i64], values: &[f32]) -> Tensor {
        Tensor { shape: shape.to_vec(), dtype: Some(Dtype::F32), data: f32_bytes(values) }
    }

    /// The values of an fp32 tensor.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        if self.dtype.map_or(false, |d| d != Dtype::F32) || self.data.len() % 4 != 0 {
            return Err(Error::invalid(format!(
                "tensor of dtype {:?} and {} bytes is not fp32",
                self.dtype,
                self.data.len()
            )));
        }
        Ok(self.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

/// Tensors by name (sorted, so iteration order is stable).
pub type TensorMap = BTreeMap<String, Tensor>;

/// Little-endian bytes of `values`.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The chunks of `tensors`, each at most `chunk_bytes` of data (a tensor of no bytes is one
/// empty chunk); the first chunk of the stream carries `session_id`. Lazy: a chunk is copied
/// only when the stream takes it.
pub(crate) fn chunks<'a>(
    session_id: &'a str,
    tensors: &'a [(&'a str, &'a [u8])],
    chunk_bytes: usize,
) -> impl Iterator<Item = proto::TensorChunk> + 'a {
    let step = chunk_bytes.clamp(1, MAX_CHUNK_BYTES);
    let mut first = true;
    tensors
        .iter()
        .flat_map(move |&(name, data)| {
            let n = if data.is_empty() { 1 } else { (data.len() + step - 1) / step };
            (0..n).map(move |i| (name, i * step, &data[i * step..data.len().min((i + 1) * step)]))
        })
        .map(move |(name, offset, piece)| {
            let session = if first { session_id.to_string() } else { String::new() };
            first = false;
            proto::TensorChunk {
                session_id: session,
                name: name.to_string(),
                offset_bytes: offset as i64,
                data: piece.to_vec(),
                ..Default::default()
            }
        })
}

/// Rebuilds tensors from a reply stream, checking that each tensor's chunks are contiguous and
/// add up to the total the daemon announced.
#[derive(Default)]
pub(crate) struct Reassembler {
    tensors: TensorMap,
    totals: BTreeMap<String, i64>,
}

impl Reassembler {
    pub fn add(&mut self, c: proto::TensorChunk) -> Result<()> {
        let shown: String = c.name.chars().take(200).collect();
        if c.offset_bytes == 0 && !self.tensors.contains_key(&c.name) {
            self.totals.insert(c.name.clone(), c.total_bytes);
            let reserve = (c.total_bytes.max(0) as usize).min(64 << 20);
            self.tensors.insert(
                c.name.clone(),
                Tensor { shape: c.shape.clone(), dtype: Dtype::from_proto(c.dtype), data: Vec::with_capacity(reserve) },
            );
        }
        let t = self.tensors.get_mut(&c.name).ok_or_else(|| {
            Error::new(
                Code::Internal,
                format!("chunk of '{shown}' at offset {} before its first chunk", c.offset_bytes),
            )
        })?;
        if c.offset_bytes != t.data.len() as i64 {
            return Err(Error::new(
                Code::Internal,
                format!("chunk of '{shown}' at offset {} but {} bytes received so far", c.offset_bytes, t.data.len()),
            ));
        }
        t.data.extend_from_slice(&c.data);
        Ok(())
    }

    pub fn finish(self) -> Result<TensorMap> {
        for (name, t) in &self.tensors {
            let total = self.totals[name];
            if total > 0 && t.data.len() as i64 != total {
                return Err(Error::new(
                    Code::Internal,
                    format!("tensor '{name}': {} of {total} announced bytes received", t.data.len()),
                ));
            }
        }
        Ok(self.tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_each_tensor_once_in_order_and_reassemble() {
        let a: Vec<u8> = (0..10u8).collect();
        let b: Vec<u8> = Vec::new();
        let c: Vec<u8> = (0..7u8).rev().collect();
        let tensors = [("a", a.as_slice()), ("b", b.as_slice()), ("c", c.as_slice())];
        let got: Vec<_> = chunks("s1", &tensors, 4).collect();
        let shape: Vec<_> = got.iter().map(|c| (c.name.as_str(), c.offset_bytes, c.data.len())).collect();
        assert_eq!(shape, vec![("a", 0, 4), ("a", 4, 4), ("a", 8, 2), ("b", 0, 0), ("c", 0, 4), ("c", 4, 3)]);
        assert_eq!(got[0].session_id, "s1");
        assert!(got[1..].iter().all(|c| c.session_id.is_empty()));
        let mut r = Reassembler::default();
        for mut ch in got {
            if ch.offset_bytes == 0 {
                ch.total_bytes = tensors.iter().find(|t| t.0 == ch.name).unwrap().1.len() as i64;
            }
            r.add(ch).unwrap();
        }
        let m = r.finish().unwrap();
        assert_eq!(m["a"].data, a);
        assert_eq!(m["b"].data, b);
        assert_eq!(m["c"].data, c);
        // Never more than the protocol's 4 MiB per chunk, whatever is asked for.
        let big = vec![0u8; MAX_CHUNK_BYTES + 1];
        let t = [("big", big.as_slice())];
        assert_eq!(chunks("", &t, usize::MAX).map(|c| c.data.len()).collect::<Vec<_>>(), vec![MAX_CHUNK_BYTES, 1]);
    }

    #[test]
    fn reassembly_rejects_gaps_and_short_tensors() {
        let mut r = Reassembler::default();
        r.add(proto::TensorChunk {
            name: "w".into(),
            offset_bytes: 0,
            data: vec![1, 2],
            total_bytes: 4,
            ..Default::default()
        })
        .unwrap();
        let e = r
            .add(proto::TensorChunk { name: "w".into(), offset_bytes: 3, data: vec![3], ..Default::default() })
            .unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        let mut r = Reassembler::default();
        assert!(r.add(proto::TensorChunk { name: "x".into(), offset_bytes: 8, ..Default::default() }).is_err());
        let mut r = Reassembler::default();
        r.add(proto::TensorChunk {
            name: "w".into(),
            offset_bytes: 0,
            data: vec![1, 2],
            total_bytes: 4,
            ..Default::default()
        })
        .unwrap();
        assert!(r.finish().is_err());
    }

    #[test]
    fn f32_tensors_round_trip_and_other_dtypes_refuse() {
        let v = [1.5f32, -0.0, f32::MIN_POSITIVE, 3.0e38];
        let t = Tensor::from_f32(&[2, 2], &v);
        assert_eq!(t.data.len(), 16);
        assert_eq!(
            t.to_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let h = Tensor { dtype: Some(Dtype::Bf16), data: vec![0; 4], ..Default::default() };
        assert!(h.to_f32().is_err());
    }
}
