//! POSIX shared-memory arenas: the trainer-side memory the daemon reads gradients from and
//! writes parameters to in place (optimizer.proto, RegisterRegion).
//!
//! A [`ShmArena`] holds both roles' arenas, sized and laid out as `CreateSession` answered, in
//! one of two kinds of shared memory:
//! - two POSIX shm segments ([`ShmArena::for_layout`], `REGION_KIND_SYSTEM_SHM`), unlinked on
//!   drop;
//! - one sealed memfd ([`ShmArena::memfd_for_layout`], `REGION_KIND_MEMFD`): `memfd_create` with
//!   `MFD_ALLOW_SEALING`, sized, then sealed with `F_SEAL_SHRINK | F_SEAL_GROW` so that its size
//!   can never change under the daemon; the parameters at offset 0, the gradients at the first
//!   page boundary after them. It has no name: the fd goes to the daemon over its fd channel
//!   ([`crate::fdchannel`]).
//!
//! Either way it hands out `&[f32]` / `&mut [f32]` views of each tensor and unmaps on drop.

use std::ffi::CString;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Code, Error, Result};
use crate::proto;
use crate::spec::Dtype;

/// Segment names start with this and carry the process id, so leaks can be found by name.
pub const SEGMENT_PREFIX: &str = "diond-rs-";

static NEXT_SEGMENT: AtomicU64 = AtomicU64::new(0);

fn os_error(what: &str) -> Error {
    Error::new(Code::Internal, format!("{what}: {}", std::io::Error::last_os_error()))
}

/// One POSIX shm segment created (O_EXCL, mode 0600) and mapped by this process.
struct Segment {
    name: String, // without the leading '/'
    ptr: *mut u8,
    len: usize, // mapped length (>= 1)
}

impl Segment {
    fn create(role: &str, bytes: usize) -> Result<Segment> {
        let name =
            format!("{SEGMENT_PREFIX}{}-{}-{role}", std::process::id(), NEXT_SEGMENT.fetch_add(1, Ordering::Relaxed));
        let cname = CString::new(format!("/{name}")).expect("no NUL in the name");
        let len = bytes.max(1);
        // SAFETY: plain libc calls on a name we own; every failure path closes and unlinks.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600);
            if fd < 0 {
                return Err(os_error(&format!("shm_open /{name}")));
            }
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = os_error(&format!("ftruncate /{name} to {len} bytes"));
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(e);
            }
            let ptr =
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            if ptr == libc::MAP_FAILED {
                let e = os_error(&format!("mmap /{name}"));
                libc::shm_unlink(cname.as_ptr());
                return Err(e);
            }
            Ok(Segment { name, ptr: ptr as *mut u8, len })
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let cname = CString::new(format!("/{}", self.name)).expect("no NUL in the name");
        // SAFETY: ptr/len are the mapping made in create(); no view outlives the arena.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
            libc::shm_unlink(cname.as_ptr());
        }
    }
}

/// One sealed memfd mapped by this process; its fd stays open (it is sent to the daemon once
/// per registered role) until the arena is dropped.
pub struct Memfd {
    fd: RawFd,
    ptr: *mut u8,
    len: usize,
    grad_offset: usize,
}

impl Memfd {
    fn create(param_bytes: usize, grad_bytes: usize) -> Result<Memfd> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(256);
        let grad_offset = (param_bytes + page - 1) / page * page;
        let len = (grad_offset + grad_bytes).max(1);
        let name = CString::new(format!("{SEGMENT_PREFIX}{}", std::process::id())).expect("no NUL in the name");
        // SAFETY: plain libc calls on an fd we own; every failure path closes it.
        unsafe {
            let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
            if fd < 0 {
                return Err(os_error("memfd_create"));
            }
            let fail = |what: &str| {
                let e = os_error(what);
                libc::close(fd);
                e
            };
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                return Err(fail(&format!("ftruncate of the memfd to {len} bytes")));
            }
            if libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != 0 {
                return Err(fail("sealing the memfd (F_SEAL_SHRINK | F_SEAL_GROW)"));
            }
            let ptr =
                libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            if ptr == libc::MAP_FAILED {
                return Err(fail("mmap of the memfd"));
            }
            Ok(Memfd { fd, ptr: ptr as *mut u8, len, grad_offset })
        }
    }

    /// The memfd (owned by the arena: do not close it).
    pub fn fd(&self) -> RawFd {
        self.fd
    }
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Where the gradient arena starts in it (the parameters start at 0).
    pub fn grad_offset(&self) -> usize {
        self.grad_offset
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in create(); no view outlives the arena.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len);
            libc::close(self.fd);
        }
    }
}

enum Backing {
    Posix { params: Segment, grads: Segment },
    Memfd(Memfd),
}

/// Where one tensor lives in the two segments.
#[derive(Clone, Debug)]
struct Slot {
    name: String,
    param_offset: usize,
    grad_offset: usize,
    size: usize,
    dtype: Option<Dtype>,
}

/// Mutable views of one tensor's parameter and gradient at once (from [`ShmArena::views_mut`]).
pub struct TensorViewMut<'a> {
    pub name: &'a str,
    pub param: &'a mut [f32],
    pub grad: &'a mut [f32],
}

/// The parameter and gradient arenas of one session, in two POSIX shm segments or one memfd.
pub struct ShmArena {
    backing: Backing,
    param_base: *mut u8,
    grad_base: *mut u8,
    param_arena_bytes: usize,
    grad_arena_bytes: usize,
    slots: Vec<Slot>,
}

impl std::fmt::Debug for ShmArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmArena")
            .field("kind", &self.kind())
            .field("param_arena_bytes", &self.param_arena_bytes)
            .field("grad_arena_bytes", &self.grad_arena_bytes)
            .field("tensors", &self.slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>())
            .finish()
    }
}

// SAFETY: the arena owns its mappings; access goes through &self / &mut self like a Vec<u8>.
unsafe impl Send for ShmArena {}
unsafe impl Sync for ShmArena {}

fn check_ranges(what: &str, arena: usize, mut ranges: Vec<(usize, usize, &str)>) -> Result<()> {
    ranges.sort();
    let mut end = 0usize;
    for (off, size, name) in ranges {
        if off % 4 != 0 || off < end || off.checked_add(size).map_or(true, |e| e > arena) {
            return Err(Error::new(
                Code::Internal,
                format!(
                    "daemon layout: {what} of '{name}' at [{off}, +{size}) overlaps or leaves the {arena}-byte arena"
                ),
            ));
        }
        end = off + size;
    }
    Ok(())
}

impl ShmArena {
    /// Creates both segments for `layout` (a `CreateSession` / `LoadCheckpoint` answer), after
    /// checking that its tensors lie inside the arenas without overlapping.
    pub fn for_layout(layout: &proto::CreateSessionResponse) -> Result<ShmArena> {
        ShmArena::build(layout, false)
    }

    /// [`ShmArena::for_layout`] in one sealed memfd (the module documentation says how).
    pub fn memfd_for_layout(layout: &proto::CreateSessionResponse) -> Result<ShmArena> {
        ShmArena::build(layout, true)
    }

    fn build(layout: &proto::CreateSessionResponse, memfd: bool) -> Result<ShmArena> {
        let as_usize = |v: i64, what: &str| -> Result<usize> {
            usize::try_from(v).map_err(|_| Error::new(Code::Internal, format!("daemon layout: negative {what} {v}")))
        };
        let param_arena_bytes = as_usize(layout.param_arena_bytes, "param_arena_bytes")?;
        let grad_arena_bytes = as_usize(layout.grad_arena_bytes, "grad_arena_bytes")?;
        let mut slots = Vec::with_capacity(layout.layout.len());
        for t in &layout.layout {
            slots.push(Slot {
                name: t.name.clone(),
                param_offset: as_usize(t.param_offset_bytes, "param_offset_bytes")?,
                grad_offset: as_usize(t.grad_offset_bytes, "grad_offset_bytes")?,
                size: as_usize(t.size_bytes, "size_bytes")?,
                dtype: Dtype::from_proto(t.dtype),
            });
        }
        check_ranges(
            "parameter",
            param_arena_bytes,
            slots.iter().map(|s| (s.param_offset, s.size, s.name.as_str())).collect(),
        )?;
        check_ranges(
            "gradient",
            grad_arena_bytes,
            slots.iter().map(|s| (s.grad_offset, s.size, s.name.as_str())).collect(),
        )?;
        let (backing, param_base, grad_base) = if memfd {
            let m = Memfd::create(param_arena_bytes, grad_arena_bytes)?;
            // SAFETY: grad_offset + grad_arena_bytes <= len (Memfd::create).
            let (p, g) = (m.ptr, unsafe { m.ptr.add(m.grad_offset) });
            (Backing::Memfd(m), p, g)
        } else {
            let params = Segment::create("params", param_arena_bytes)?;
            let grads = Segment::create("grads", grad_arena_bytes)?;
            let (p, g) = (params.ptr, grads.ptr);
            (Backing::Posix { params, grads }, p, g)
        };
        Ok(ShmArena { backing, param_base, grad_base, param_arena_bytes, grad_arena_bytes, slots })
    }

    /// `REGION_KIND_SYSTEM_SHM` or `REGION_KIND_MEMFD`.
    pub fn kind(&self) -> proto::RegionKind {
        match self.backing {
            Backing::Posix { .. } => proto::RegionKind::SystemShm,
            Backing::Memfd(_) => proto::RegionKind::Memfd,
        }
    }
    /// Bytes of the parameter and of the gradient arena.
    pub fn arena_bytes(&self) -> (usize, usize) {
        (self.param_arena_bytes, self.grad_arena_bytes)
    }
    /// The `RegisterRegion` body for the parameter segment (POSIX shm arenas only).
    pub fn param_region(&self) -> Option<proto::SystemShmRegion> {
        match &self.backing {
            Backing::Posix { params, .. } => Some(proto::SystemShmRegion {
                name: params.name.clone(),
                offset_bytes: 0,
                size_bytes: self.param_arena_bytes as i64,
            }),
            Backing::Memfd(_) => None,
        }
    }
    /// The `RegisterRegion` body for the gradient segment (POSIX shm arenas only).
    pub fn grad_region(&self) -> Option<proto::SystemShmRegion> {
        match &self.backing {
            Backing::Posix { grads, .. } => Some(proto::SystemShmRegion {
                name: grads.name.clone(),
                offset_bytes: 0,
                size_bytes: self.grad_arena_bytes as i64,
            }),
            Backing::Memfd(_) => None,
        }
    }
    /// Segment names (without '/') of a POSIX shm arena: parameters, gradients.
    pub fn segment_names(&self) -> Option<(&str, &str)> {
        match &self.backing {
            Backing::Posix { params, grads } => Some((&params.name, &grads.name)),
            Backing::Memfd(_) => None,
        }
    }
    /// The memfd of a memfd arena.
    pub fn memfd(&self) -> Option<&Memfd> {
        match &self.backing {
            Backing::Posix { .. } => None,
            Backing::Memfd(m) => Some(m),
        }
    }
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots.iter().find(|s| s.name == name).ok_or_else(|| {
            let shown: String = name.chars().take(200).collect();
            Error::new(Code::NotFound, format!("no tensor '{shown}' in this session's layout"))
        })
    }
    fn f32_slot(&self, name: &str) -> Result<&Slot> {
        let s = self.slot(name)?;
        if s.dtype != Some(Dtype::F32) {
            return Err(Error::invalid(format!("tensor '{}' is {:?}, not fp32: use the byte views", s.name, s.dtype)));
        }
        Ok(s)
    }

    /// A parameter's bytes in the trainer's dtype.
    pub fn param_bytes(&self, name: &str) -> Result<&[u8]> {
        let s = self.slot(name)?;
        // SAFETY: the range was checked against the mapping in for_layout.
        Ok(unsafe { std::slice::from_raw_parts(self.param_base.add(s.param_offset), s.size) })
    }
    pub fn param_bytes_mut(&mut self, name: &str) -> Result<&mut [u8]> {
        let s = self.slot(name)?.clone();
        Ok(unsafe { std::slice::from_raw_parts_mut(self.param_base.add(s.param_offset), s.size) })
    }
    pub fn grad_bytes(&self, name: &str) -> Result<&[u8]> {
        let s = self.slot(name)?;
        Ok(unsafe { std::slice::from_raw_parts(self.grad_base.add(s.grad_offset), s.size) })
    }
    pub fn grad_bytes_mut(&mut self, name: &str) -> Result<&mut [u8]> {
        let s = self.slot(name)?.clone();
        Ok(unsafe { std::slice::from_raw_parts_mut(self.grad_base.add(s.grad_offset), s.size) })
    }

    /// An fp32 parameter (offsets are 256-aligned, so the cast is aligned).
    pub fn param(&self, name: &str) -> Result<&[f32]> {
        let s = self.f32_slot(name)?;
        Ok(unsafe { std::slice::from_raw_parts(self.param_base.add(s.param_offset) as *const f32, s.size / 4) })
    }
    pub fn param_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let s = self.f32_slot(name)?.clone();
        Ok(unsafe { std::slice::from_raw_parts_mut(self.param_base.add(s.param_offset) as *mut f32, s.size / 4) })
    }
    pub fn grad(&self, name: &str) -> Result<&[f32]> {
        let s = self.f32_slot(name)?;
        Ok(unsafe { std::slice::from_raw_parts(self.grad_base.add(s.grad_offset) as *const f32, s.size / 4) })
    }
    pub fn grad_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let s = self.f32_slot(name)?.clone();
        Ok(unsafe { std::slice::from_raw_parts_mut(self.grad_base.add(s.grad_offset) as *mut f32, s.size / 4) })
    }

    /// Every fp32 tensor's parameter and gradient views at once, in layout order (what a
    /// backward pass needs: read the weights, write the gradients). The ranges do not overlap
    /// (checked in for_layout), so the views are disjoint.
    pub fn views_mut(&mut self) -> Result<Vec<TensorViewMut<'_>>> {
        let mut out = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            if s.dtype != Some(Dtype::F32) {
                return Err(Error::invalid(format!("tensor '{}' is {:?}, not fp32", s.name, s.dtype)));
            }
            // SAFETY: disjoint, in-bounds ranges of mappings that live as long as &mut self.
            unsafe {
                out.push(TensorViewMut {
                    name: s.name.as_str(),
                    param: std::slice::from_raw_parts_mut(self.param_base.add(s.param_offset) as *mut f32, s.size / 4),
                    grad: std::slice::from_raw_parts_mut(self.grad_base.add(s.grad_offset) as *mut f32, s.size / 4),
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> proto::CreateSessionResponse {
        proto::CreateSessionResponse {
            session_id: "s".into(),
            layout: vec![
                proto::TensorLayout {
                    name: "a".into(),
                    param_offset_bytes: 0,
                    grad_offset_bytes: 256,
                    size_bytes: 24,
                    shape: vec![2, 3],
                    dtype: 1,
                },
                proto::TensorLayout {
                    name: "b".into(),
                    param_offset_bytes: 256,
                    grad_offset_bytes: 0,
                    size_bytes: 8,
                    shape: vec![2],
                    dtype: 1,
                },
            ],
            param_arena_bytes: 512,
            grad_arena_bytes: 512,
            alignment_bytes: 256,
            ..Default::default()
        }
    }

    fn shm_exists(name: &str) -> bool {
        std::path::Path::new("/dev/shm").join(name).exists()
    }

    #[test]
    fn views_write_the_segments_and_drop_unlinks_them() {
        let mut a = ShmArena::for_layout(&layout()).unwrap();
        let (p, g) = a.segment_names().unwrap();
        let (p, g) = (p.to_string(), g.to_string());
        assert!(p.starts_with(SEGMENT_PREFIX) && shm_exists(&p) && shm_exists(&g));
        a.param_mut("a").unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        a.grad_mut("b").unwrap().copy_from_slice(&[7.0, 8.0]);
        {
            let mut v = a.views_mut().unwrap();
            v[1].param[1] = 9.0;
            v[0].grad[0] = -1.0;
        }
        assert_eq!(a.param("a").unwrap(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(a.param("b").unwrap(), &[0.0, 9.0]);
        assert_eq!(a.grad("a").unwrap()[0], -1.0);
        // The bytes really are in the shared segment, where the daemon looks.
        let raw = std::fs::read(format!("/dev/shm/{p}")).unwrap();
        assert_eq!(&raw[0..4], &1.0f32.to_le_bytes());
        assert_eq!(&raw[260..264], &9.0f32.to_le_bytes());
        assert_eq!(a.param_region().unwrap().size_bytes, 512);
        assert_eq!(a.kind(), proto::RegionKind::SystemShm);
        assert_eq!(a.param("zz").unwrap_err().code(), Code::NotFound);
        drop(a);
        assert!(!shm_exists(&p) && !shm_exists(&g));
    }

    #[test]
    fn a_memfd_arena_is_one_sealed_memfd_with_the_gradients_after_the_parameters_page() {
        let mut a = ShmArena::memfd_for_layout(&layout()).unwrap();
        assert_eq!(a.kind(), proto::RegionKind::Memfd);
        assert!(a.segment_names().is_none() && a.param_region().is_none());
        a.param_mut("a").unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        a.grad_mut("b").unwrap().copy_from_slice(&[7.0, 8.0]);
        let m = a.memfd().unwrap();
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        assert_eq!(m.grad_offset(), page); // 512 parameter bytes round up to one page
        assert_eq!(m.len(), page + 512);
        // Sealed against shrinking and growing, not against writing.
        let seals = unsafe { libc::fcntl(m.fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW), libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        assert_eq!(seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE), 0);
        assert_ne!(unsafe { libc::ftruncate(m.fd(), 1) }, 0, "a sealed memfd cannot shrink");
        // The bytes are in the memfd where the daemon will map them (read back through the fd).
        let raw = std::fs::read(format!("/proc/self/fd/{}", m.fd())).unwrap();
        assert_eq!(raw.len(), page + 512);
        assert_eq!(&raw[20..24], &6.0f32.to_le_bytes());
        assert_eq!(&raw[page..page + 8], &[7.0f32.to_le_bytes(), 8.0f32.to_le_bytes()].concat()[..]);
    }

    #[test]
    fn a_layout_that_overlaps_or_leaves_the_arena_is_refused() {
        let mut l = layout();
        l.layout[1].param_offset_bytes = 16; // overlaps "a"
        assert_eq!(ShmArena::for_layout(&l).err().unwrap().code(), Code::Internal);
        let mut l = layout();
        l.layout[0].grad_offset_bytes = 500; // 500 + 24 > 512
        assert!(ShmArena::for_layout(&l).is_err());
        let mut l = layout();
        l.layout[0].size_bytes = -4;
        assert!(ShmArena::for_layout(&l).is_err());
    }
}
