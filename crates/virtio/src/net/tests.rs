use super::*;

#[test]
fn rarp_frame_names_the_mac_twice_and_is_padded() {
    let mac = [0x52, 0x54, 0, 1, 2, 3];
    let frame = rarp_frame(&mac);
    assert_eq!(frame.len(), VNET_HDR_LEN + 60);
    let eth = &frame[VNET_HDR_LEN..];
    assert_eq!(&eth[..6], &[0xff; 6]);
    assert_eq!(&eth[6..12], &mac);
    assert_eq!(&eth[12..14], &[0x80, 0x35]);
    assert_eq!(&eth[20..22], &[0, 3]);
    assert_eq!(&eth[22..28], &mac);
    assert_eq!(&eth[32..38], &mac);
}
