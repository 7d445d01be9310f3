//! Feeds arbitrary bytes to every decoder of the wire protocol.
#![no_main]

use cuda_lease::proto::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let _ = Header::decode(data, &limits);
    if let Ok(f) = Frame::decode(data, &limits) {
        match f.header.opcode {
            Opcode::Batch => {
                let _ = from_body::<Batch>(&f.body).map(|b| b.validate(f.data.len()));
            }
            Opcode::GpuSubmit => {
                let _ = from_body::<GpuSubmit>(&f.body).map(|s| s.validate(f.data.len(), &limits));
            }
            Opcode::MemAlloc => {
                let _ = from_body::<MemAlloc>(&f.body);
            }
            Opcode::MemFree => {
                let _ = from_body::<IdOp>(&f.body);
            }
            _ => {}
        }
    }
    let _ = from_body::<Hello>(data);
    let _ = from_body::<Inventory>(data);
    let _ = from_body::<LeaseAlloc>(data);
    let _ = from_body::<LeaseStatus>(data);
    let _ = from_body::<MemRead>(data);
    let _ = from_body::<LaunchSpec>(data).map(|l| l.validate(false));
    let _ = from_body::<Batch>(data);
    let _ = from_body::<BatchReply>(data);
    let _ = from_body::<GpuSubmit>(data);
    // The hand-written command reader: serde's values, serde's refusals.
    assert_eq!(
        CommandList::from_wire(data).ok(),
        from_body::<CommandList>(data).ok()
    );
});
