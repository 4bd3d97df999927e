#!/usr/bin/env python3
# Host emulation of kernels/gemv_q.cu's bit tricks (byte_perm code placement, Q4_K scale
# unpacking, Q6_K 6-bit assembly, Q8_0 magic, gq_lds16 realignment) against a direct decode
# of random blocks (the layout of kernels/quant_blocks.h). No GPU needed: python3 tests/gpu/gemv_q_emu.py
import random, struct
def bp(x, y, s):
    b = list(x.to_bytes(4,'little')) + list(y.to_bytes(4,'little'))
    return int.from_bytes(bytes(b[(s >> (4*i)) & 7] for i in range(4)), 'little')
def f32(u): return struct.unpack('<f', struct.pack('<I', u & 0xffffffff))[0]
def words(bs, off): return [int.from_bytes(bytes(bs[off+4*i:off+4*i+4]),'little') for i in range(4)]
M=0xffffffff
def half_plus(b,e): return f32(bp(b,0x3f000000,0x7044|(e<<8)))
def k4_ref(b):  # element -> (scale, min, q)
    sc=b[4:16]; out={}
    for e in range(256):
        s=e>>5; l=e&31
        if s<4: S=sc[s]&63; Mn=sc[s+4]&63
        else: S=(sc[s+4]&0xf)|((sc[s-4]>>6)<<4); Mn=(sc[s+4]>>4)|((sc[s]>>6)<<4)
        q=(b[16+32*(s>>1)+l]>>((s&1)*4))&0xf
        out[e]=(S,Mn,q)
    return out
def q4(b):
    ref=k4_ref(b); hx,hy,hz,hw=words(b,0)
    for p in range(8):
        j=p>>1; l0=(p&1)*16; sh=16*(j&1)
        sc = hy&0x3f3f3f3f if j<2 else (hw&0x0f0f0f0f)|((hy>>2)&0x30303030)
        mn = hz&0x3f3f3f3f if j<2 else ((hw>>4)&0x0f0f0f0f)|((hz>>2)&0x30303030)
        q=words(b,16+16*p)
        for hf in range(2):
            S=(sc>>(sh+8*hf))&0xff; Mn=(mn>>(sh+8*hf))&0xff
            for g in range(2):
                w0,w1=q[2*g],q[2*g+1]
                b0=((w0>>1) if hf else (w0<<3))&0x78787878; b1=((w1>>1) if hf else (w1<<3))&0x78787878
                fs=[half_plus(b0,e) for e in range(4)]+[half_plus(b1,e) for e in range(4)]
                for e in range(8):
                    el=64*j+32*hf+l0+8*g+e
                    assert ref[el]==(S,Mn,32*fs[e]-16), (p,hf,g,e,ref[el],S,Mn,32*fs[e]-16)
def q6(b):
    for p in range(8):
        h=p>>2;a=(p>>1)&1;c=p&1
        ql=words(b,64*h+32*a+16*c); qh=words(b,128+32*h+16*c)
        for hf in range(2):
            scidx=192+8*h+c+2*a+4*hf
            for g in range(2):
                l=[ql[2*g],ql[2*g+1]]; u=[qh[2*g],qh[2*g+1]]
                fs=[]
                for w in range(2):
                    hb=u[w]>>(2*a)
                    bb=((((l[w]>>3) if hf else (l[w]<<1))&0x1e1e1e1e) | (((hb<<1) if hf else (hb<<5))&0x60606060))&M
                    fs+= [half_plus(bb,e) for e in range(4)]
                for e in range(8):
                    el=128*h+32*(a+2*hf)+16*c+8*g+e
                    half=el>>7; r=el&127; uu=r>>5; ll=r&31
                    qlb=b[64*half+(uu&1)*32+ll]; qhb=b[128+32*half+ll]
                    qref=((qlb>>((uu>>1)*4))&0xf)|(((qhb>>(2*uu))&3)<<4)
                    scref=192+8*half+(ll>>4)+2*uu
                    assert scref==scidx and 128*fs[e]-64==qref, (p,hf,g,e)
def q8(b):
    q=[words(b,2),words(b,18)]
    for g in range(4):
        v=q[g>>1]; lo=(v[2] if g&1 else v[0])^0x80808080; hi=(v[3] if g&1 else v[1])^0x80808080
        fs=[f32(bp(lo,0x4b000000,0x7440|e))-8388736.0 for e in range(4)]+[f32(bp(hi,0x4b000000,0x7440|e))-8388736.0 for e in range(4)]
        for e in range(8):
            qq=b[2+8*g+e]; qq = qq-256 if qq>127 else qq
            assert fs[e]==qq
random.seed(1)
for it in range(300):
    q4(bytes(random.getrandbits(8) for _ in range(144)))
    q6(bytes(random.getrandbits(8) for _ in range(210)))
    q8(bytes(random.getrandbits(8) for _ in range(34)))
print("decoders ok")
# lds16 realign
mem=bytes(random.getrandbits(8) for _ in range(64))
for p in range(0,40,2):
    base=p&~3; w=[int.from_bytes(mem[base+4*i:base+4*i+4],'little') for i in range(5)]
    sel=0x5432 if p&2 else 0x3210
    got=b''.join(bp(w[i],w[i+1],sel).to_bytes(4,'little') for i in range(4))
    assert got==mem[p:p+16]
print("lds16 ok")
